"""The decode gRPC service (engine role "decode")."""

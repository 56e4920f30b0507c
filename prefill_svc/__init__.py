"""The prefill gRPC service (engine role "prefill")."""

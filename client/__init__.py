"""pdserve's client SDK: ``from client import AsyncClient, Client``."""
from client.async_client import AsyncClient
from client.errors import (AlreadyExistsError, CancelledError, DeadlineExceededError,
                           FailedPreconditionError, InternalError, InvalidArgumentError,
                           NotFoundError, PdserveError, ResourceExhaustedError,
                           UnauthenticatedError, UnavailableError, UnimplementedError)
from client.failover import FailoverPolicy
from client.sync_client import Client
from client.tool_calls import ParsedReply, ToolCall, parse_hermes_tool_calls
from client.response_format import response_format_schema
from client.tool_choice import forced_tool_calls, tool_choice_schema
from client.tool_parsers import (TOOL_CALL_SYNTAXES, parse_llama3_json_tool_calls,
                                 parse_mistral_tool_calls, parse_pythonic_tool_calls,
                                 parse_tool_calls)
from client.tool_stream import StreamedReply, ToolCallStream
from client.types import (Chat, Choice, Completion, GenerationChunk, ModelIdentity, ModelInfo,
                          Timings, Tokenized, TokenLogprobs, Usage)

__all__ = ["AsyncClient", "Client", "FailoverPolicy", "Chat", "Tokenized", "ModelInfo",
           "ModelIdentity", "Completion", "Choice", "GenerationChunk",
           "Usage", "Timings", "TokenLogprobs", "PdserveError", "InvalidArgumentError",
           "ResourceExhaustedError", "UnavailableError", "DeadlineExceededError",
           "CancelledError", "NotFoundError", "InternalError", "UnauthenticatedError",
           "FailedPreconditionError", "AlreadyExistsError", "UnimplementedError",
           "parse_hermes_tool_calls", "parse_llama3_json_tool_calls",
           "parse_mistral_tool_calls", "parse_pythonic_tool_calls", "parse_tool_calls",
           "TOOL_CALL_SYNTAXES", "ParsedReply", "ToolCall", "ToolCallStream",
           "StreamedReply", "tool_choice_schema", "forced_tool_calls",
           "response_format_schema"]

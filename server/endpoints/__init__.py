"""The RPC surface: gRPC servicer, local RPC socket, fd broker, input validation."""

"""Wire schema (gRPC): the .proto files and their generated modules."""

"""Generated protobuf and gRPC code for the trajmesh.v1 contract (do not edit; regenerate from proto/)."""

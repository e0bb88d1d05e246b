"""Protocol-free serving code that both adapters (HTTP and gRPC) share."""

"""The data plane: metadata index, storage units, and the put/get client."""

"""Moving KV from prefill to decode: the backend interface, Mooncake and NIXL backends, the room handshake."""

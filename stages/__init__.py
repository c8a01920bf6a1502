"""Stage servers (encoder, prefill, decode, colocated) and the engine they run."""

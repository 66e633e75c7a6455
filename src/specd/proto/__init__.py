"""Generated protocol code (speculative.v1); see scripts/gen_protos.py."""

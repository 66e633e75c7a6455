"""The drafter service: proposes token blocks for many sequences at once."""

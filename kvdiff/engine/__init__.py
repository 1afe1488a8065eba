"""The chunked-generation engine and the reference continuous path."""

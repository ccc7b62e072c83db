"""The daemon's core: links to GPU peers and the generation service over them."""

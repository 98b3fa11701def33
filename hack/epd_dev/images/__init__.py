"""Local container images for the real node, built offline with buildah (recipes.py, build.py)."""

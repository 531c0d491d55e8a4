"""Recipes that build ditrun's artefacts (the trained editor): they import the package, never the reverse."""

"""icl-select's support modules: the stage scripts and model.py at the repository root import from here."""

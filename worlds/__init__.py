"""The tiny worlds UniRL's recipes train in: each a package of its own beside the framework, reached
from a recipe only by `_target_` (scorers, data sources, prompt builders), as a user's own world is."""

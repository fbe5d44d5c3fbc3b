"""Tree tuning: acceptance and cost measured through the same Drafters that decode, and the tree
search as pure functions (``acceptance``, ``cost``, ``search``), run by ``tune.tune_tree``."""

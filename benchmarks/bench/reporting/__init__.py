"""The results of a `tandem bench` run: text tables, ratios, JSON and a plot."""

"""One-off measurements, each behind a decision: a script whose docstring says how to run it."""

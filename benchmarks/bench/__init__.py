"""`tandem bench`: the load generator, the workloads, the systems it starts side by side, the report."""

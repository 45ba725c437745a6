"""What `tandem bench` sends: the closed-loop load generator (loadgen.py),
what every workload shares with the basic ones (core.py: sweep,
interference, prefix, swarm), and a module per larger workload."""

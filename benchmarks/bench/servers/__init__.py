"""The systems `tandem bench` compares: started, watched and stopped
(systems.py), and the weights the peers load (peer_weights.py)."""

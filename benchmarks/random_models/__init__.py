"""`tandem random-model`: folders of a real model's shape with random weights (text.py, VLMs vlm.py)."""

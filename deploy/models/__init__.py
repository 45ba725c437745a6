"""The models on this machine: `tandem pull` downloads one from the Hugging
Face Hub (pull_cmd.py), `tandem list` and `tandem rm` show and delete the
downloaded ones (models_cmd.py). Where models live and which files they need:
environment/hub_cache.py; the download: environment/hub_pull.py."""

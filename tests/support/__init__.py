"""What tests share; a test file imports from here, never from another test file.

- tiny_models.py: tiny random llama / Gemma 3 / Qwen3-Next folders, prompts,
  greedy settings, mlx-lm's reference tokens (the `tiny_dir` and `model`
  fixtures are in tests/conftest.py).
- pipeline.py: prefill -> handoff -> decode in one process (`drive`) and
  mlx-lm's run to compare it with.
- cache_fakes.py: the cache service (`FakeCacheService`) and the embedding
  store (`FakeEmbeddingStore`) in memory.
- decoding.py: greedy decode over a prefilled cache, as a decode worker does.
- tiny_vlms.py, vision.py: tiny random VLMs; our vision path and mlx-vlm's.
- server.py: a real `tandem serve` in a process group; vision_chat.py and
  embedded_chat.py: chats with one and their references.
- dispatcher.py: the router's dispatcher with scripted workers.
- fake_engine.py: a scripted engine and tokenizer for the HTTP layer.
- gguf_fixtures.py, media.py: GGUF files and videos written for tests.
- groups.py: the worker-group tests' random models, prompts, asks and
  one-process references; ane.py: the Neural Engine tests' tiny models and
  float16-rounded weights.
"""

"""The served model's text side, without MLX or transformers: its tokenizer
(tokenizer.py: the `tokenizers` library over tokenizer.json), its chat
template rendered as transformers renders it (chat_template.py), the tool
calls it writes (tool_calls.py) and tokens back to text as they stream
(text_stream.py)."""

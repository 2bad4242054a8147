"""Reading checkpoints: a Hugging Face directory or a GGUF file (``reader``, ``gguf``), the model
used when a config names none (``demo``), and corellm's on-disk cache (``cache``)."""

"""Checkpoints in the released Hugging Face layout (Kimi Linear, DeepSeek-V3 / Moonlight): read as
kimijax models (config.json as model keys: kimijax.hf.config; the safetensors tensors as
parameters: kimijax.hf.weights), and a kimijax model written back to that layout
(kimijax.hf.export). docs/released.md says what is read and written and how to run it."""

"""Released checkpoints in the Hugging Face layout (Kimi Linear, DeepSeek-V3 / Moonlight) as kimijax
models: config.json as model keys (kimijax.hf.config), the safetensors tensors as parameters
(kimijax.hf.weights). docs/released.md says what is read and how to run it."""

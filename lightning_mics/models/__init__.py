from lightning_mics.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]

from lightning_mics.app.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]

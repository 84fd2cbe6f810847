"""Step-schedule protocol requests the tests send (../shared/seeds/004_*: InferenceRequest)."""


def greedy_linear(prompt: list, generated: int = 8) -> dict:
    """`generated` tokens after `prompt`, one step per token on a linear schedule, greedy."""
    return {
        "prompt_tokens": prompt,
        "target_length": len(prompt) + generated,
        "num_steps": generated,
        "mask_schedule": "linear",
        "temperature_schedule": [0.0] * generated,
        "top_p": 1.0,
    }

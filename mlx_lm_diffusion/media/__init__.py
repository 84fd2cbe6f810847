"""Images and video for the doors: reading them safely, mlx-vlm's processor, image prompts."""

"""The chat REPL driven from a script (tests/cli/test_chat.py, tests/model_adapters/test_gemma_images.py)."""

from mlx_lm_diffusion.cli import chat


class ScriptedUI:
    """ChatUI's interface, fed from a list of queries (end of input after the last)."""

    def __init__(self, queries):
        self.queries = list(queries)
        self.turns, self.current, self.events = [], "", []

    def prompt(self):
        if not self.queries:
            raise EOFError
        return self.queries.pop(0)

    def stream_token(self, text):
        self.current += text

    def end_turn(self, response):
        self.turns.append(self.current)
        self.current = ""

    def say_bye(self):
        self.events.append("bye")

    def say_reset(self):
        self.events.append("reset")

    def say_help(self):
        self.events.append("help")


def args_for(path, *extra):
    return chat.setup_arg_parser().parse_args(["--model", str(path), "--max-tokens", "10", *extra])

"""The terminal doors: the generate CLI, the chat REPL, the converter and the live canvas view."""

"""Errors the engine raises on purpose; each carries a message fit for a user."""


class EngineError(Exception):
    """Base class: a request or setup the engine refuses, with a clear reason."""


class ModelLoadError(EngineError):
    pass


class PromptTooLongError(EngineError):
    def __init__(self, prompt_tokens: int, context_window: int):
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window
        super().__init__(
            f"prompt is too long: {prompt_tokens} tokens > {context_window} maximum"
        )


class InvalidRequestError(EngineError):
    pass


class CancelledError(EngineError):
    pass


class EngineDownError(EngineError):
    """The engine takes no more requests until it is restarted (a split model lost a rank)."""

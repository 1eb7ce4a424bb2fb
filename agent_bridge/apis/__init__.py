"""The wire formats: OpenAI chat/completions, Anthropic messages, OpenAI Responses, one stream driver,
and the server-sent events they write."""

"""The wire formats: OpenAI chat/completions, Anthropic messages, OpenAI Responses, one stream driver."""

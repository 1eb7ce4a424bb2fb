"""The engine's ground floor: errors, events, sampling, stop rules, the chat template, the platform and its folders. Imports nothing else of the engine."""

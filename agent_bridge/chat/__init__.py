"""One internal chat request and what reading a model's reply needs: media, tool-call parsing, turn replay, thinking signatures, HTTP errors, JSON request bodies."""

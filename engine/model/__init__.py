"""The target model: loading, forwards (tapped, batched), images."""

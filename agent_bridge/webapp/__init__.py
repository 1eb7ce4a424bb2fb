"""The web app `mlx-dspark serve` serves at `/`: chat, live telemetry, roofline, prefix cache,
integrations. Plain HTML/CSS/JS under static/ (no build step); its API is in routes.py."""

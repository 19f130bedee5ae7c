"""`vlbatch inspect`: `text.run_inspect` the command (the terminal report), `run` reading a run, `cards` the
sampled media, `clips` clip timelines, `html` the page with `thumbnails`. Importing this package imports nothing."""

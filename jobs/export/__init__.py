"""`vlbatch export`: `command.run_export` the command (its docstring states the rules), `parts` the parts checked,
`media` a row per media (typed by `types`), `write` the files. Importing this package imports nothing."""

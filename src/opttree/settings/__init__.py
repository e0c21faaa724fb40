"""What configures a generation, checked once: `config.SpecConfig` (the tree settings and their checks),
`drafter_spec.DrafterSpec` (a drafter text parsed into sources with their declared capabilities),
`names` (the built-in policy and source names, importable without torch), `declared` (the hooks a
drafter or depth control declares), `arguments` (a call's prompt, mask and options). Nothing here imports
the step's stages (`opttree.step`), which read these."""

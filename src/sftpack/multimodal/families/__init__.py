"""The vision-language model families, one module each, behind :class:`sftpack.multimodal.Family`.

Imported only through :func:`sftpack.multimodal.family_for` (by name, from
``sftpack.multimodal._family.FAMILIES``): the paths, the loop, the CLI and the report
never import a family module (an import-linter contract). Adding a family is one
module here and its line in ``FAMILIES``.
"""

"""Entry points: one thin module per MLproject entry point (`python -m steps.<name> --<param> v`)."""

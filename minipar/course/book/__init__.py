"""The web book: every notebook executed, built into a static site with Sphinx and MyST-NB."""

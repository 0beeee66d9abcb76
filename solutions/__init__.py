"""The library's own code for every piece of ``exercises/``, generated from the same markers
(``python -m minipar.course.exercise --write``), so it can never drift from minipar."""

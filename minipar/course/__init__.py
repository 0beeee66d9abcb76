"""The course around the library: exercises, grading, hints, challenges, chapters, the web book."""

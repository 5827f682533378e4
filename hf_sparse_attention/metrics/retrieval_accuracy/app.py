"""Gradio widget of the metric when this folder is published as a Hub Space."""

import os

import evaluate
from evaluate.utils import launch_gradio_widget

module = evaluate.load(os.path.dirname(os.path.abspath(__file__)))
launch_gradio_widget(module)

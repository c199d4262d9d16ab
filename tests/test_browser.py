"""The course as a learner sees it: JupyterLab in a real (headless) browser.

Starts JupyterLab on 127.0.0.1, opens notebooks in Debian's Chromium through Playwright,
runs them and checks what a learner sees: the setup cell reports where kernels run; a
learner notebook stops at its first exercise with gpulab's short message; the
interactive views of the solutions render as widgets and redraw on a key press;
matplotlib figures render; the browser console shows no error beyond unreachable badge
images. Installs nothing: Playwright comes from requirements.txt, Chromium from
tools/ensure-chromium.sh (run by the test command); without Chromium the test skips.

``GPULAB_SCREENSHOTS=DIR`` saves a screenshot of each view there (docs/ holds them).
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in requirements.txt")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no Chromium on this machine: run tools/ensure-chromium.sh (installs Debian's chromium; "
                "Playwright cannot download browsers here)", allow_module_level=True)

BADGE_HOSTS = ("colab.research.google.com", "mybinder.org")
TIMEOUT_MS = 180_000       # a loaded 2-core CI machine: kernels start and run slowly


def cells_tagged(nb_path, tag):
    return [c for c in nbformat.read(nb_path, as_version=4).cells if tag in c.metadata.get("tags", [])]


def views_notebook(path: Path) -> None:
    """The solutions' interactive-view cells, with the cells they need, in one notebook."""
    sol = ROOT / "solutions"
    nb04 = nbformat.read(sol / "04_flash_attention.ipynb", as_version=4)
    setup = next(c for c in nb04.cells if c.cell_type == "code" and "gpulab.setup()" in c.source)
    scores = next(c for c in nb04.cells if "def score_rows" in c.source)      # also draws a figure
    cells = [setup, nbformat.v4.new_code_cell("from gpulab import paged"), scores]
    for name in ("04_flash_attention", "05_paged_attention", "00_triton_basics"):
        cells += cells_tagged(sol / f"{name}.ipynb", "gpulab-view")
    # notebook 07's scheduler timeline: its setup and model cells, then the view
    nb07 = nbformat.read(sol / "07_serving.ipynb", as_version=4)
    cells += [next(c for c in nb07.cells if c.cell_type == "code" and "gpulab.setup()" in c.source),
              next(c for c in nb07.cells if c.cell_type == "code" and "model = load_checkpoint(" in c.source)]
    cells += cells_tagged(sol / "07_serving.ipynb", "gpulab-view")
    cells += cells_tagged(sol / "00_triton_basics.ipynb", "gpulab-progress")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.source) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One JupyterLab server per test: run after another notebook's test in the same server,
# the views notebook's run-all did not start within the timeout (its kernel was ready).
@pytest.fixture
def lab(tmp_path_factory):
    work = tmp_path_factory.mktemp("lab")
    shutil.copy(ROOT / "notebooks/00_triton_basics.ipynb", work / "learner_00.ipynb")
    views_notebook(work / "views.ipynb")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}    # the kernel's inline backend
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), CI="true",
               JUPYTERLAB_WORKSPACES_DIR=str(work / ".workspaces"), JUPYTER_RUNTIME_DIR=str(work / ".runtime"),
               GPULAB_HOME=str(work / ".gpulab"))
    log = open(work / "lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--allow-root", "--no-browser", "--ip", "127.0.0.1",
         f"--port={port}", "--IdentityProvider.token=", "--ServerApp.password=",
         "--LabApp.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=True",
         f"--ServerApp.root_dir={work}"],
        cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                    json.load(r)
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError("JupyterLab did not start:\n" + (work / "lab.log").read_text()[-3000:])
                time.sleep(0.5)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
                "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage"])
            yield url, browser, work
            browser.close()
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def open_and_run(browser, url, notebook):
    """Open a notebook in JupyterLab, run all its cells; returns (page, console errors)."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("console", lambda msg: errors.append((msg.text, msg.location.get("url", "")))
            if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append((str(exc), "")))
    page.goto(f"{url}/lab/tree/{notebook}", timeout=TIMEOUT_MS)
    page.wait_for_function("window.jupyterapp && window.jupyterapp.shell", timeout=TIMEOUT_MS)
    page.wait_for_function(KERNEL_READY, timeout=TIMEOUT_MS)
    # not awaited: the command's promise settles only when every cell has run
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    return page, errors


KERNEL_READY = """() => {
    const w = window.jupyterapp.shell.currentWidget;
    const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
    return k && k.connectionStatus === 'connected' && k.status === 'idle'; }"""
RUN_FINISHED = """() => {
    const w = window.jupyterapp.shell.currentWidget;
    return w.content.widgets.every(c => c.model.type !== 'code' || !c.promptNode ||
                                        !c.promptNode.textContent.includes('*'))
           && w.sessionContext.session.kernel.status === 'idle'; }"""


def wait_idle(page):
    page.wait_for_timeout(500)
    page.wait_for_function(RUN_FINISHED, timeout=TIMEOUT_MS)


def shut_down_kernels(url):
    """Each notebook starts its own kernel: stop it so the next test has the cores."""
    with urllib.request.urlopen(f"{url}/api/kernels", timeout=10) as r:
        kernels = json.load(r)
    for k in kernels:
        req = urllib.request.Request(f"{url}/api/kernels/{k['id']}", method="DELETE")
        urllib.request.urlopen(req, timeout=10).close()


def unexpected(errors):
    """Console errors other than the Colab/Binder badge images (no internet here)."""
    return [(text, where) for text, where in errors
            if not any(host in where or host in text for host in BADGE_HOSTS)]


def test_learner_notebook_stops_at_the_first_exercise_with_a_short_message(lab):
    url, browser, _ = lab
    page, errors = open_and_run(browser, url, "learner_00.ipynb")
    error = page.wait_for_selector(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                                   timeout=TIMEOUT_MS)
    wait_idle(page)
    text = " ".join(error.text_content().split())
    assert "Exercise ex1-add-kernel is not finished: `add_kernel` still has its placeholder" in text
    assert "Traceback" not in text and "interpreter.py" not in text and len(text) < 600
    outputs = page.locator(".jp-Cell .jp-OutputArea-output")
    assert "gpulab mode: interpreter" in outputs.first.text_content()      # the setup cell
    # nothing ran after the failing check: later code cells have no output
    cells = page.locator(".jp-CodeCell")
    failing = next(i for i in range(cells.count())
                   if cells.nth(i).locator("[data-mime-type='application/vnd.jupyter.stderr']").count())
    assert all(cells.nth(i).locator(".jp-OutputArea-output").count() == 0
               for i in range(failing + 1, cells.count()))
    assert not unexpected(errors), unexpected(errors)
    page.close()
    shut_down_kernels(url)


def test_solution_views_render_as_widgets_and_respond_to_keys(lab):
    url, browser, work = lab
    page, errors = open_and_run(browser, url, "views.ipynb")
    page.wait_for_function("document.querySelectorAll('.gpulab-view img').length >= 4", timeout=TIMEOUT_MS)
    wait_idle(page)
    assert "gpulab mode: interpreter" in page.locator(".jp-OutputArea-output").first.text_content()
    # a matplotlib figure (the score shapes of notebook 04) rendered as an image
    assert page.locator(".jp-OutputArea-output[data-mime-type='image/png'] img").count() >= 1
    assert "Course:" in page.locator(".jp-OutputArea-output").last.text_content()     # the progress cell
    shots = Path(os.environ.get("GPULAB_SCREENSHOTS") or work)
    views = page.locator(".gpulab-view")
    assert views.count() == 4
    for i, name in enumerate(("view-running-max", "view-page-pool", "view-roofline", "view-timeline")):
        view = views.nth(i)
        view.scroll_into_view_if_needed()
        view.screenshot(path=str(shots / f"{name}.png"))
        img = view.locator("img").first
        before = img.get_attribute("src")
        view.locator(".noUi-handle, .widget-slider [role='slider']").first.focus()
        page.keyboard.press("ArrowRight")
        page.wait_for_function("([el, old]) => el.getAttribute('src') !== old",
                               arg=[img.element_handle(), before], timeout=30_000)
    assert not unexpected(errors), unexpected(errors)
    page.close()
    shut_down_kernels(url)

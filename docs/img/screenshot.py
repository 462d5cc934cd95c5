"""Screenshot TensorBoard in headless Chromium once its line charts have drawn (DevTools protocol).

How docs/img/tensorboard.png was taken (Debian's `chromium`; `websockets` comes with Ray):

    python -m jobs.train --preset synthetic --set run.loggers=[console,jsonl,tensorboard] \
        --set run.output_dir=/tmp/demo
    tensorboard --logdir /tmp/demo --host 127.0.0.1 --port 6006 &
    python docs/img/screenshot.py \
        "http://127.0.0.1:6006/?tagFilter=rollouts%7Ctokens%7Ctrained%7Closs%7Ctrainer_idle&smoothing=0#timeseries" \
        docs/img/tensorboard.png

`chromium --screenshot` alone races TensorBoard's lazily drawn cards (empty cards, or none); this
waits until every card has drawn.
"""
import asyncio, base64, json, subprocess, sys, tempfile, time, urllib.request
import websockets

URL, OUT = sys.argv[1], sys.argv[2]
PORT = 9333
proc = subprocess.Popen(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                         "--disable-background-networking", "--disable-component-update", "--disable-sync",
                         f"--user-data-dir={tempfile.mkdtemp()}", "--window-size=1500,1000",
                         f"--remote-debugging-port={PORT}", "about:blank"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(100):
        try:
            targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{PORT}/json"))
            page = next(t for t in targets if t["type"] == "page")
            break
        except Exception:
            time.sleep(0.2)

    async def main():
        async with websockets.connect(page["webSocketDebuggerUrl"], max_size=50 << 20) as ws:
            n = 0
            async def call(method, **params):
                nonlocal n
                n += 1
                await ws.send(json.dumps({"id": n, "method": method, "params": params}))
                while True:
                    msg = json.loads(await ws.recv())
                    if msg.get("id") == n:
                        return msg.get("result", {})
            await call("Emulation.setDeviceMetricsOverride", width=1500, height=1000, deviceScaleFactor=1, mobile=False)
            await call("Page.navigate", url=URL)
            # Wait until every card has drawn its line (TensorBoard lazily renders cards into canvases/SVG).
            check = ("(() => { const cards = document.querySelectorAll('scalar-card-component, tb-scalar-card');"
                     " const drawn = [...cards].filter(c => c.querySelector('line-chart canvas, line-chart svg path, canvas'));"
                     " return JSON.stringify({cards: cards.length, drawn: drawn.length}); })()")
            state = None
            for _ in range(120):
                state = json.loads((await call("Runtime.evaluate", expression=check, returnByValue=True))["result"]["value"])
                if state["cards"] and state["drawn"] == state["cards"]:
                    break
                await asyncio.sleep(0.5)
            # Full y ranges (TensorBoard clips outliers by default) and the settings pane closed.
            tidy = ("(() => { for (const box of document.querySelectorAll('mat-checkbox')) {"
                    " if (box.textContent.includes('Ignore outliers') && box.querySelector('input').checked)"
                    " box.querySelector('input').click(); }"
                    " const close = document.querySelector('.right-pane button[aria-label*=\"lose\"],"
                    " button[aria-label=\"Close side pane\"]'); if (close) close.click(); })()")
            await call("Runtime.evaluate", expression=tidy)
            await asyncio.sleep(3)  # let the last draw settle
            print("state", state)
            shot = await call("Page.captureScreenshot", format="png")
            open(OUT, "wb").write(base64.b64decode(shot["data"]))
    asyncio.run(main())
finally:
    proc.terminate()
    proc.wait(10)

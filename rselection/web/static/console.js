// The rselection console's live refresh: every few seconds, fetch this page again and
// swap its content in, unless the operator is using a form. The pages work without it.
(function () {
  "use strict";
  var seconds = Number(document.body.getAttribute("data-refresh")) || 0;
  if (seconds <= 0 || !window.fetch || !window.DOMParser) { return; }
  var busy = false;

  function inUse(live) {
    var active = document.activeElement;
    return active && active !== document.body && live.contains(active) &&
      /^(SELECT|INPUT|TEXTAREA)$/.test(active.tagName);
  }

  function refresh() {
    var live = document.getElementById("live");
    if (busy || !live || document.visibilityState === "hidden" || inUse(live)) { return; }
    busy = true;
    fetch(window.location.href, { credentials: "same-origin", cache: "no-store" })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (text) {
        if (text === null) { return; }
        var fresh = new DOMParser().parseFromString(text, "text/html").getElementById("live");
        if (fresh && !inUse(live)) { live.replaceChildren.apply(live, Array.from(fresh.childNodes)); }
      })
      .catch(function () { /* the server is away: try again next time */ })
      .then(function () { busy = false; });
  }

  document.addEventListener("submit", function (event) {
    var message = event.target.getAttribute("data-confirm");
    if (message && !window.confirm(message)) { event.preventDefault(); }
  });
  window.setInterval(refresh, seconds * 1000);
}());

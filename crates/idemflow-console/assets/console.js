// idemflow console: the one thing script adds is asking before an action. Without it, the server
// answers an unconfirmed action with a confirmation page instead.
"use strict";
document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll("form[data-confirm]").forEach(function (form) {
    form.addEventListener("submit", function (event) {
      if (!window.confirm(form.getAttribute("data-confirm"))) {
        event.preventDefault();
        return;
      }
      var confirmed = form.querySelector("input[name=confirmed]");
      if (confirmed) { confirmed.value = "yes"; }
    });
  });
});

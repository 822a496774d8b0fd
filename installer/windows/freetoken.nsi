; FreeToken Windows installer (NSIS 3, Unicode).
; Per-user install without admin rights; Start-menu and optional desktop shortcut; the uninstaller
; keeps the user's models and settings unless asked; installing over an older version upgrades in place.
;
;   makensis /DVERSION=0.1.0 /DBUNDLE=..\..\dist\FreeToken /DOUTFILE=FreeToken-0.1.0-setup.exe freetoken.nsi

Unicode true
!include "MUI2.nsh"
!include "LogicLib.nsh"
!include "FileFunc.nsh"
!include "x64.nsh"

!ifndef VERSION
  !define VERSION "0.0.0"
!endif
!ifndef BUNDLE
  !define BUNDLE "..\..\dist\FreeToken"
!endif
!ifndef OUTFILE
  !define OUTFILE "FreeToken-${VERSION}-setup.exe"
!endif
!ifndef ICON
  !define ICON "..\..\resources\icons\freetoken.ico"
!endif

!define APPNAME "FreeToken"
!define UNINSTKEY "Software\Microsoft\Windows\CurrentVersion\Uninstall\FreeToken"
; Where platformdirs puts the user's data on Windows (models, chats, settings, logs, cache).
!define USERDATA "$LOCALAPPDATA\FreeToken"

Name "${APPNAME} ${VERSION}"
OutFile "${OUTFILE}"
RequestExecutionLevel user                      ; no UAC prompt: everything goes under the user's profile
InstallDir "$LOCALAPPDATA\Programs\${APPNAME}"
InstallDirRegKey HKCU "Software\${APPNAME}" "InstallDir"   ; an upgrade lands where the last install did
!ifdef FAST_COMPRESSION
  SetCompressor zlib            ; a quick compile that only proves the script (the smoke test on Linux)
!else
  SetCompressor /SOLID lzma     ; the release: smallest download
!endif

!define MUI_ABORTWARNING
!define MUI_ICON "${ICON}"
!define MUI_UNICON "${ICON}"
!define MUI_FINISHPAGE_RUN "$INSTDIR\FreeToken.exe"
!define MUI_FINISHPAGE_RUN_TEXT "Start FreeToken"
!insertmacro MUI_PAGE_WELCOME
!insertmacro MUI_PAGE_COMPONENTS
!insertmacro MUI_PAGE_DIRECTORY
!insertmacro MUI_PAGE_INSTFILES
!insertmacro MUI_PAGE_FINISH
!insertmacro MUI_UNPAGE_CONFIRM
!insertmacro MUI_UNPAGE_COMPONENTS
!insertmacro MUI_UNPAGE_INSTFILES
!insertmacro MUI_LANGUAGE "English"

Function .onInit
  ; Warn, never block: without an NVIDIA driver FreeToken runs models on the CPU only.
  ; The installer is 32-bit: look in the real System32, not SysWOW64 (nvml.dll is 64-bit only).
  ${DisableX64FSRedirection}
  ${IfNot} ${FileExists} "$SYSDIR\nvml.dll"
  ${AndIfNot} ${FileExists} "$SYSDIR\nvcuda.dll"
    MessageBox MB_ICONINFORMATION|MB_OK "No NVIDIA driver was found. FreeToken will install and run models on the CPU only (slowly). Install the NVIDIA driver to use your GPU." /SD IDOK
  ${EndIf}
  ${EnableX64FSRedirection}
  ; A running copy would hold files open during an upgrade.
  FindWindow $0 "" "FreeToken"
  ${If} $0 <> 0
    MessageBox MB_ICONEXCLAMATION|MB_OKCANCEL "FreeToken is running. Close it, then press OK to continue." /SD IDOK IDOK +2
    Abort
  ${EndIf}
FunctionEnd

Section "FreeToken (required)" SecMain
  SectionIn RO
  SetOutPath "$INSTDIR"
  ; Upgrade in place: replace the program files, never the user's data (it lives in ${USERDATA}).
  RMDir /r "$INSTDIR\_internal"
  File /r "${BUNDLE}\*.*"
  WriteUninstaller "$INSTDIR\Uninstall.exe"
  WriteRegStr HKCU "Software\${APPNAME}" "InstallDir" "$INSTDIR"
  WriteRegStr HKCU "${UNINSTKEY}" "DisplayName" "${APPNAME}"
  WriteRegStr HKCU "${UNINSTKEY}" "DisplayVersion" "${VERSION}"
  WriteRegStr HKCU "${UNINSTKEY}" "Publisher" "FreeToken"
  WriteRegStr HKCU "${UNINSTKEY}" "DisplayIcon" "$INSTDIR\FreeToken.exe"
  WriteRegStr HKCU "${UNINSTKEY}" "UninstallString" '"$INSTDIR\Uninstall.exe"'
  WriteRegStr HKCU "${UNINSTKEY}" "QuietUninstallString" '"$INSTDIR\Uninstall.exe" /S'
  WriteRegDWORD HKCU "${UNINSTKEY}" "NoModify" 1
  WriteRegDWORD HKCU "${UNINSTKEY}" "NoRepair" 1
  ${GetSize} "$INSTDIR" "/S=0K" $0 $1 $2
  WriteRegDWORD HKCU "${UNINSTKEY}" "EstimatedSize" "$0"
  CreateDirectory "$SMPROGRAMS\${APPNAME}"
  CreateShortcut "$SMPROGRAMS\${APPNAME}\${APPNAME}.lnk" "$INSTDIR\FreeToken.exe"
  CreateShortcut "$SMPROGRAMS\${APPNAME}\Uninstall ${APPNAME}.lnk" "$INSTDIR\Uninstall.exe"
SectionEnd

Section /o "Desktop shortcut" SecDesktop
  CreateShortcut "$DESKTOP\${APPNAME}.lnk" "$INSTDIR\FreeToken.exe"
SectionEnd

!insertmacro MUI_FUNCTION_DESCRIPTION_BEGIN
  !insertmacro MUI_DESCRIPTION_TEXT ${SecMain} "The FreeToken app, its local API server and command line."
  !insertmacro MUI_DESCRIPTION_TEXT ${SecDesktop} "A shortcut on the desktop."
!insertmacro MUI_FUNCTION_DESCRIPTION_END

Section "un.FreeToken (program files)" UnSecMain
  SectionIn RO
  RMDir /r "$INSTDIR\_internal"
  Delete "$INSTDIR\FreeToken.exe"
  Delete "$INSTDIR\freetoken-cli.exe"
  Delete "$INSTDIR\Uninstall.exe"
  RMDir "$INSTDIR"
  Delete "$SMPROGRAMS\${APPNAME}\${APPNAME}.lnk"
  Delete "$SMPROGRAMS\${APPNAME}\Uninstall ${APPNAME}.lnk"
  RMDir "$SMPROGRAMS\${APPNAME}"
  Delete "$DESKTOP\${APPNAME}.lnk"
  DeleteRegKey HKCU "${UNINSTKEY}"
  DeleteRegKey HKCU "Software\${APPNAME}"
SectionEnd

; Off by default: models are tens of gigabytes the user downloaded and converted.
Section /o "un.Also delete my models, chats and settings" UnSecData
  RMDir /r "${USERDATA}"
SectionEnd
